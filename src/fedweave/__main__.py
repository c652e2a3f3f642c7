from fedweave.cli import main

raise SystemExit(main())
