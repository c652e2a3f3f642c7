"""The ``fedweave`` command, one module per concern:

==============  =====================================================================
``main``        parse the command line, run the command, a user's mistake as one line
``parser``      the commands and their arguments (imports nothing heavy: ``--help`` is instant)
``outcome``     what a failed command prints and its exit status
``run``         ``run`` (federated and data-parallel), ``report``, ``status``
``nodes``       the nodes of a deployment: ``server``, ``client``, ``site``, ``certs``,
                ``worker``, ``join``, and ``deploy`` (manifests)
``keys``        the federation's HE keys: ``keys``, ``decrypt``
``listing``     what can be configured: ``schema``, ``list``
==============  =====================================================================
"""

from fedweave.cli.main import main

__all__ = ["main"]
