"""The job store: ids in submission order, records rewritten whole, a second process (a restart) sees it all."""

from __future__ import annotations

from pathlib import Path

from fedweave.federation.store import JobStore


def test_jobs_keep_their_fifo_order_and_state_across_a_new_store_on_the_same_folder(tmp_path: Path) -> None:
    store = JobStore(tmp_path)
    ids = [store.submit({"name": f"j{i}", "rounds": 2}, None, None, "ada")["id"] for i in range(11)]
    assert ids[:2] == ["job-0001", "job-0002"] and ids[-1] == "job-0011"
    store.update("job-0002", state="running", clients={"alpha": 0})
    store.set_site("job-0002", "alpha", state="accepted")
    store.set_site("job-0002", "alpha", state="running")
    again = JobStore(tmp_path)  # what a restarted service reads
    assert again.ids() == ids  # job-0010 after job-0009: by number, not by name
    record = again.get("job-0002")
    assert record["state"] == "running" and record["sites"] == {"alpha": {"state": "running"}}
    assert record["rounds"] == 2 and record["submitted_by"] == "ada" and record["bundle_sha256"] is None
    assert again.config("job-0003") == {"name": "j2", "rounds": 2}
    assert again.submit({}, b"tar", "0" * 64, "ada")["id"] == "job-0012"
    assert again.bundle("job-0012") == b"tar" and again.bundle("job-0001") is None
    assert not [p for p in tmp_path.rglob("*") if p.name.startswith(".")]  # no temp file left behind
    assert again.get("job-9999") is None and again.get("../etc") is None
