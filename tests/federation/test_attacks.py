"""Attacks on the site-side building blocks (policy, catalogue, bundles, audit log), each found working
once and fixed: a job, a bundle or a log crafted to get past what a site's rules promise."""

from __future__ import annotations

import fcntl
import io
import os
import re
import tarfile
import threading

import pytest

from fedweave.errors import ConfigError
from fedweave.federation.audit import AuditError, AuditLog
from fedweave.federation.bundle import BundleError, digest, modules, pack, unpack
from fedweave.federation.catalog import Catalog, resolve
from fedweave.federation.policy import SitePolicy


def refusal(policy: dict, job: dict, bundle: str | None = None, **kw):
    return SitePolicy.from_dict(policy).check(job, bundle, **kw)


# ---------------------------------------------------------------------------------------------- policy


def test_a_catalog_or_torchvision_prefix_smuggles_no_import_outside_task_dataset():
    # task.model, task.loss, task.metrics import package.module:function: 'catalog:x' imports a module 'catalog'
    for job in ({"task": {"model": "catalog:evil"}}, {"task": {"loss": "torchvision:evil"}},
                {"task": {"metrics": ["catalog:evil"]}}, {"strategy": "catalog:Evil"},
                {"plugins": {"client_send": ["torchvision:Evil"]}}, {"eval": {"server_function": "catalog:f"}}):
        found = refusal({"code": "never"}, job)
        assert found is not None and found.rule == "policy.code", job
    assert refusal({"code": "never"}, {"task": {"dataset": "catalog:cardiology"}}) is None


def test_the_adaptive_controller_cannot_train_past_the_local_work_ceilings():
    # controller adaptive (adjust steps, the default) gives each client the steps its speed allows, up to
    # controller.max_steps (none: no limit): local.epochs and local.steps bound only the first round
    greedy = {"controller": {"kind": "adaptive", "target_round_time": 1e9, "min_steps": 10**9}}
    found = refusal({"max_local_epochs": 1}, greedy)
    assert found.rule == "policy.max_local_epochs" and "controller.max_steps" in found.reason
    found = refusal({"max_local_steps": 100}, greedy)
    assert found.rule == "policy.max_local_steps" and "controller.max_steps" in found.reason
    found = refusal({"max_local_steps": 100}, {"controller": "adaptive", "local": {"steps": 50}})
    assert found.rule == "policy.max_local_steps"
    capped = {"controller": {"kind": "adaptive", "max_steps": 200}, "local": {"steps": 50}}
    assert refusal({"max_local_steps": 100}, capped).reason == "the job asks controller.max_steps=200; this site allows at most 100"
    capped["controller"]["max_steps"] = 100
    assert refusal({"max_local_steps": 100, "max_local_epochs": 1}, capped) is None
    # adjust batch_size keeps local.steps (required), which the existing rules bound
    by_batch = {"controller": {"kind": "adaptive", "adjust": "batch_size"}, "local": {"steps": 5}}
    assert refusal({"max_local_steps": 5}, by_batch) is None


def test_dittos_personal_steps_cannot_train_past_the_local_work_ceilings():
    # Ditto trains the personal model strategy.personal_steps steps after the global model's local work
    ditto = {"strategy": {"name": "ditto", "personal_steps": 10**9}, "local": {"epochs": 1}}
    found = refusal({"max_local_epochs": 1}, ditto)
    assert found.rule == "policy.max_local_epochs" and "strategy.personal_steps" in found.reason
    found = refusal({"max_local_steps": 100}, ditto)
    assert found == type(found)("policy.max_local_steps", "the job asks strategy.personal_steps=1000000000; this site allows at most 100")
    ditto["strategy"]["personal_steps"] = 100
    assert refusal({"max_local_steps": 100, "max_local_epochs": 1}, ditto) is None
    assert refusal({"max_local_epochs": 1}, {"strategy": {"name": "ditto", "lam": 0.5}}) is None


def test_seeded_privacy_noise_does_not_count_as_noise():
    # seeded_noise: true draws the noise from the run seed every node reads in the config: the server can
    # draw it again and subtract it, so the update leaves the site as good as un-noised
    seeded = {"plugins": {"client_send": [{"name": "dp_local", "noise_multiplier": 5.0, "seeded_noise": True}]}}
    found = refusal({"min_dp_noise": 1.0}, seeded)
    assert found.rule == "policy.min_dp_noise" and "plugins.client_send[0].seeded_noise" in found.reason
    seeded["plugins"]["client_send"][0]["seeded_noise"] = "yes"  # any value but false is not fresh noise
    assert refusal({"min_dp_noise": 1.0}, seeded).rule == "policy.min_dp_noise"
    seeded["plugins"]["client_send"][0]["seeded_noise"] = False
    assert refusal({"min_dp_noise": 1.0}, seeded) is None
    both = {"plugins": {"client_send": [{"name": "dpsgd", "noise_multiplier": 0.5},
                                        {"name": "dp_local", "noise_multiplier": 5.0, "seeded_noise": True}]}}
    assert refusal({"min_dp_noise": 1.0}, both).reason == "the job's noise_multiplier is 0.5; this site needs >= 1"


def test_a_job_names_no_homomorphic_encryption_keys_on_the_site():
    # he's keys is a folder the site's client reads secret.ctx from: relative, it is the job's own folder,
    # where its bundle is unpacked (keys the job's author made and can decrypt each update with); absolute,
    # any folder of the site. Either way the job chose a path on the site, and require_secure_aggregation
    # would have counted it as secure aggregation.
    for keys in ("code/keys", "/srv/other-study/keys"):
        job = {"plugins": {"client_send": [{"name": "he", "keys": keys}]}}
        found = refusal({"require_secure_aggregation": "he"}, job)
        assert found.rule == "policy.catalog" and f"plugins.client_send[0].keys {keys!r}" in found.reason
        assert refusal({}, job).rule == "policy.catalog"  # whatever the policy, as task.data_root
    assert refusal({"require_secure_aggregation": "he"}, {"plugins": {"client_send": ["he"]}}) is None


def test_a_refusal_quotes_no_more_than_a_line_of_what_the_job_wrote():
    # a reason goes to both audit logs and to the server: a megabyte strategy name made a megabyte line there
    huge = "x" * 10**6
    jobs = [
        ({"strategies": ["fedavg"]}, {"strategy": huge}),
        ({"plugins": ["clip"]}, {"plugins": {"client_send": [huge]}}),
        ({"topologies": ["star"]}, {"topology": {"kind": huge}}),
        ({}, {"task": {"dataset": "files", "dataset_options": {"path": huge}}}),
        ({}, {"task": {"data_root": huge}}),
        ({"catalog": ["a"]}, {"task": {"dataset": "catalog:" + huge}}),
        ({"max_rounds": 5}, {"rounds": [huge]}),
        ({"max_rounds": 5}, {"rounds": 10**4000}),
        ({"max_rounds": 5}, {"rounds": 10**5000}),  # more digits than Python writes
        ({"max_local_steps": 5}, {"local": {"steps": 10**4000}}),
        ({}, {"plugins": {huge: ["clip"]}}),
        ({}, {"task": {"model": "m:" + huge}}),
        ({}, {"task": {"partition": {"file": {i: huge for i in range(10)}}}}),
    ]
    for policy, job in jobs:
        found = refusal(policy, job)
        assert found is not None and len(found.reason) < 400 and "\n" not in found.reason, (policy, found.reason[:200])
    # an attachment point the loader does not know is refused by the first rule reading plugins
    assert refusal({}, {"plugins": {"client_sends": ["clip"]}}).reason.startswith("job key 'plugins' holds 'client_sends'")


def test_an_empty_list_of_secure_aggregations_is_no_silent_requirement():
    # require_secure_aggregation: [] loaded, and then required nothing: a job without any was admitted
    with pytest.raises(ConfigError, match=r"^config key 'policy.require_secure_aggregation': an empty list requires nothing"):
        SitePolicy.from_dict({"require_secure_aggregation": []})


# ---------------------------------------------------------------------------------------------- bundle


def _tar(members: list[tuple[str, bytes]]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as archive:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


@pytest.mark.parametrize("name", [".", "./", "x" * 200 + "\x00.py", "a\nb.py", "m\x1b[2J.py"])
def test_a_member_name_that_is_no_file_name_is_a_bundle_error(tmp_path, name):
    # '.' crashed unpack with an IndexError, a NUL (a PAX header carries one) with a ValueError: neither is
    # the BundleError the site turns into a refusal
    data = _tar([(name, b"x = 1\n")])
    with pytest.raises(BundleError, match="bundle member"):
        unpack(data, digest(data), tmp_path / "code")
    assert not (tmp_path / "code").exists() and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("members", [[("a", b"1"), ("a/b.py", b"2")], [("a/b.py", b"1"), ("a", b"2")],
                                     [("d/" + "n" * 300 + ".py", b"1")]])
def test_a_member_that_cannot_be_written_is_named_without_the_sites_folders(tmp_path, members):
    # the reason goes to the federation server: "not a readable archive ([Errno 17] File exists:
    # '/srv/site/work/job-1/.code.x1/a')" told it the site's folders, and blamed the archive
    data = _tar(members)
    with pytest.raises(BundleError) as error:
        unpack(data, digest(data), tmp_path / "code")
    message = str(error.value)
    assert str(tmp_path) not in message and "bundle member" in message and "readable" not in message
    assert list(tmp_path.iterdir()) == []


def test_an_unpack_onto_a_folder_that_appeared_meanwhile_says_so_without_the_sites_path(tmp_path, monkeypatch):
    # two offers of one job unpack at once: the second rename finds the first's folder (ENOTEMPTY), which
    # was reported as an unreadable archive, with the site's path
    data = _tar([("m.py", b"x = 1\n")])
    dest = tmp_path / "work" / "code"
    rename = os.rename

    def racing(src, dst):
        monkeypatch.setattr(os, "rename", rename)
        unpack(data, digest(data), dest)  # the other unpack wins the race
        rename(src, dst)

    monkeypatch.setattr(os, "rename", racing)
    with pytest.raises(BundleError) as error:
        unpack(data, digest(data), dest)
    assert str(error.value) == "bundle: the folder it unpacks into (code) exists already"
    assert sorted(p.name for p in dest.parent.iterdir()) == ["code"]  # the loser's staging folder removed


def test_an_unpack_onto_a_dangling_link_is_refused_as_existing(tmp_path):
    data = _tar([("m.py", b"x = 1\n")])
    (tmp_path / "code").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(BundleError, match=r"^bundle: the folder it unpacks into \(code\) exists already$"):
        unpack(data, digest(data), tmp_path / "code")
    assert not (tmp_path / "elsewhere").exists() and [p.name for p in tmp_path.iterdir()] == ["code"]


@pytest.mark.parametrize("name", ["types.py", "json/__init__.py", "fedweave/__init__.py", "torch/x.py",
                                  "numpy.cpython-311-x86_64-linux-gnu.so", "os.pyc", "logging/handlers.py"])
def test_a_bundle_module_never_shadows_an_installed_one(tmp_path, name):
    # the bundle's folder comes first on the client's PYTHONPATH: a bundle's types.py or fedweave/ is
    # imported in place of the site's own (by every job's client, whether the job names it or not)
    data = _tar([(name, b"import os\n"), ("mymodels.py", b"x = 1\n")])
    with pytest.raises(BundleError, match=r"would be imported in place of the installed module"):
        unpack(data, digest(data), tmp_path / "code")
    assert list(tmp_path.iterdir()) == []
    if name.endswith(".pyc"):
        return  # pack leaves compiled files out
    folder = tmp_path / "src"
    (folder / name).parent.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text("import os\n")
    with pytest.raises(BundleError, match=r"would be imported in place of the installed module"):
        pack(folder)  # the careless user learns it at submit


@pytest.mark.parametrize("name", ["sitecustomize.py", "usercustomize.py", "sitecustomize/__init__.py"])
def test_a_bundle_holds_no_module_python_runs_at_start_up(tmp_path, name):
    # Python imports sitecustomize from its path when it starts: the client ran it before any job code was
    # named, whatever the references the policy held to the bundle's modules
    data = _tar([(name, b"import os\n")])
    with pytest.raises(BundleError, match=r"is '(site|user)customize', which Python runs when it starts"):
        unpack(data, digest(data), tmp_path / "code")


def test_a_bundle_of_own_modules_is_not_taken_for_shadowing(tmp_path):
    folder = tmp_path / "src"
    (folder / "mystudy").mkdir(parents=True)
    (folder / "mystudy" / "__init__.py").write_text("")
    (folder / "mymodels.py").write_text("x = 1\n")
    (folder / "README.md").write_text("notes\n")  # no module: any name
    data = pack(folder)
    assert modules(unpack(data, digest(data), tmp_path / "code")) == ["mymodels", "mystudy"]


# ---------------------------------------------------------------------------------------------- audit


@pytest.mark.parametrize(
    "tail",
    [
        b"\n",  # a blank line: the tail read skipped every newline and chained onto the record before it
        b'{"hash":"' + b"f" * 64 + b'"}\n',  # a forged line holding only a hash, which the next append chained to
        b'{"event":"x","fields":{},"hash":"' + b"f" * 64 + b'","prev":"' + b"0" * 64 + b'","time":"t"}\n',
        b"[1, 2]\n",
    ],
)
def test_a_log_is_never_extended_past_a_last_line_that_is_no_record(tmp_path, tail):
    log = AuditLog(tmp_path / "audit.jsonl")
    log.append("submitted", who="admin", job="j1")
    with open(log.path, "ab") as out:
        out.write(tail)
    with pytest.raises(AuditError, match="line 2 is not a whole record; nothing appended after it"):
        log.append("refused", site="lab-a", job="j1")
    with pytest.raises(AuditError, match="line 2"):
        log.head()
    assert log.path.read_bytes().count(b"\n") == 2  # nothing appended


@pytest.mark.parametrize("read", ["verify", "records", "head"])
def test_readers_wait_for_a_writer_holding_the_log(tmp_path, read):
    # a reader that does not take the lock can read a line a writer has half written and call the log broken
    log = AuditLog(tmp_path / "audit.jsonl")
    log.append("submitted", who="admin", job="j1")
    done = threading.Event()
    fd = os.open(log.path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # a writer mid-append
        reader = threading.Thread(target=lambda: (getattr(log, read)(), done.set()), daemon=True)
        reader.start()
        reader.join(0.5)
        assert not done.is_set()  # it waits (on a loaded host this only passes sooner, never fails)
    finally:
        os.close(fd)  # the writer's lock released
    reader.join(30)
    assert done.is_set()


def test_records_of_a_log_cut_off_mid_line_is_an_audit_error(tmp_path):
    # a writer killed mid-line (or a full disk) left half a record: records() raised json's own
    # JSONDecodeError, which nothing reading the log for `fedweave job` expects
    log = AuditLog(tmp_path / "audit.jsonl")
    log.append("submitted", who="admin", job="j1")
    with open(log.path, "ab") as out:
        out.write(b'{"event":"acc')
    with pytest.raises(AuditError, match="line 2 is not JSON") as error:
        log.records()
    assert error.value.line == 2


# ---------------------------------------------------------------------------------------------- catalog


@pytest.mark.parametrize(
    ("task", "plugins", "key"),
    [
        ({"data_root": "/home"}, {}, "task.data_root"),
        ({"partition": {"scheme": "from_file", "file": "/etc/rows.json"}}, {}, "task.partition.file"),
        ({}, {"client_send": [{"name": "he", "keys": "/srv/keys"}]}, "plugins.client_send[0].keys"),
    ],
)
def test_resolve_never_hands_the_client_a_path_the_job_named(tmp_path, task, plugins, key):
    # resolve copied every key but the dataset's options: a caller resolving a job it had not checked with
    # SitePolicy.check first handed the client the job's task.data_root, partition file or HE keys folder
    (tmp_path / "cardiology.csv").write_text("a,outcome\n1,0\n")
    catalog = Catalog.from_dict({"cardiology": {"path": "cardiology.csv", "label": "outcome"}}, base=tmp_path)
    job = {"task": {"dataset": "catalog:cardiology", **task}, "plugins": plugins}
    with pytest.raises(ConfigError, match=rf"^config key '{re.escape(key)}': a path on the site"):
        resolve(job, catalog)
    odd = {"task": {"dataset": "catalog:cardiology"}, "plugins": {"client_send": [{"name": ["he"]}, "he", 3]}}
    assert resolve(odd, catalog)[0]["plugins"] == odd["plugins"]  # shapes the loader refuses, not a crash here
    config, data = resolve({"task": {"dataset": "catalog:cardiology"}}, catalog)
    assert data == tmp_path / "cardiology.csv" and config["task"]["dataset"] == "files"
