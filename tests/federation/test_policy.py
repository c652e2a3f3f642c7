"""A site's policy: every rule allowed and refused by hand-made jobs, and its load errors."""

from __future__ import annotations

import pytest

from fedweave.errors import ConfigError
from fedweave.federation.policy import ORDER, Refusal, SitePolicy, user_code

BUNDLE = "ab" * 32
OTHER = "cd" * 32


def refused(policy: dict, job: dict, bundle: str | None = None, **kw) -> Refusal | None:
    return SitePolicy.from_dict(policy).check(job, bundle, **kw)


def test_an_empty_policy_admits_a_plain_job_and_refuses_code():
    assert refused({}, {"rounds": 50, "strategy": "scaffold"}) is None
    assert refused({}, {}, BUNDLE).rule == "policy.code"
    assert SitePolicy.from_dict(None).describe() == {"code": "never"}


def test_code_never_refuses_a_bundle_and_user_code_references():
    for job in ({"strategy": {"name": "mine.algo:Algo"}}, {"task": {"model": "mine.models:net"}},
                {"task": {"metrics": ["accuracy", "mine.m:worst"]}}, {"eval": {"server_function": "x:y"}},
                {"plugins": {"client_send": ["mine.p:Plug"]}}, {"selection": "mine.s:Pick"}):
        refusal = refused({"code": "never"}, job)
        assert refusal is not None and refusal.rule == "policy.code", job
    refusal = refused({"code": "never"}, {}, BUNDLE)
    assert refusal.rule == "policy.code" and BUNDLE in refusal.reason and "no code bundle" in refusal.reason
    # colons that name no module: built-in datasets and catalogue entries
    assert refused({}, {"task": {"dataset": "torchvision:mnist"}}) is None
    assert refused({}, {"task": {"dataset": "catalog:cardiology"}}) is None


def test_code_listed_hashes():
    policy = {"code": [BUNDLE]}
    job = {"strategy": "mine.algo:Algo"}
    assert refused(policy, job, BUNDLE) is None
    refusal = refused(policy, job, OTHER)
    assert refusal.rule == "policy.code" and OTHER in refusal.reason and BUNDLE in refusal.reason
    assert refused(policy, job).rule == "policy.code"  # user code with no bundle: site-installed modules
    assert refused(policy, job, BUNDLE, bundle_modules=["mine"]) is None
    refusal = refused(policy, {"task": {"loss": "os:system"}}, BUNDLE, bundle_modules=["mine"])
    assert refusal.rule == "policy.code" and "'os'" in refusal.reason


def test_code_any():
    assert refused({"code": "any"}, {"strategy": "os:system"}, OTHER) is None


def test_strategies():
    policy = {"strategies": ["fedavg", "fedprox"]}
    assert refused(policy, {}) is None  # the default strategy, fedavg
    assert refused(policy, {"strategy": {"name": "fedprox", "mu": 0.1}}) is None
    refusal = refused(policy, {"strategy": "scaffold"})
    assert refusal == Refusal("policy.strategies", "the job asks strategy 'scaffold'; this site accepts fedavg, fedprox")
    assert refused({"strategies": ["fedprox"]}, {}).rule == "policy.strategies"


def test_plugins_every_one_listed():
    policy = {"plugins": ["clip", "dp_local"]}
    assert refused(policy, {"plugins": {"client_send": [{"name": "clip", "max_norm": 1.0}, "dp_local"]}}) is None
    refusal = refused(policy, {"plugins": {"client_send": ["clip"], "server_send": ["topk"]}})
    assert refusal.rule == "policy.plugins" and "'topk'" in refusal.reason and "plugins.server_send[0]" in refusal.reason


def test_topologies():
    assert refused({"topologies": ["star"]}, {}) is None
    assert refused({"topologies": ["star"]}, {"topology": "ring"}).rule == "policy.topologies"
    assert refused({"topologies": ["hierarchical"]}, {"topology": {"kind": "hierarchical", "sites": 2}}) is None


def test_catalog_entries_and_raw_paths():
    files = {"task": {"dataset": "files", "dataset_options": {"path": "catalog:cardiology"}}}
    assert refused({"catalog": ["cardiology"]}, files) is None
    assert refused({"catalog": ["cardiology"]}, {"task": {"dataset": "catalog:cardiology"}}) is None
    refusal = refused({"catalog": ["oncology"]}, files)
    assert refusal.rule == "policy.catalog" and "'cardiology'" in refusal.reason and "oncology" in refusal.reason
    assert refused({"catalog": ["oncology"]}, {"task": {"dataset": "digits"}}) is None  # no site data read
    raw = {"task": {"dataset": "files", "dataset_options": {"path": "/etc/passwd"}}}
    refusal = refused({}, raw)  # never a path on the site, whatever the policy
    assert refusal.rule == "policy.catalog" and "/etc/passwd" in refusal.reason
    assert "with no path" in refused({}, {"task": {"dataset": "files"}}).reason
    for job in ({"task": {"dataset": "torchvision:mnist", "data_root": "/home"}},
                {"task": {"partition": {"scheme": "from_file", "file": "/etc/rows.json"}}}):
        refusal = refused({}, job)
        assert refusal.rule == "policy.catalog" and "a path on the site" in refusal.reason


def test_min_dp_noise():
    policy = {"min_dp_noise": 1.1}
    refusal = refused(policy, {})
    assert refusal.rule == "policy.min_dp_noise" and "no differential privacy" in refusal.reason
    low = {"plugins": {"client_send": [{"name": "dp_local", "noise_multiplier": 0.5}]}}
    assert refused(policy, low) == Refusal("policy.min_dp_noise", "the job's noise_multiplier is 0.5; this site needs >= 1.1")
    high = {"plugins": {"client_send": [{"name": "dp_local", "noise_multiplier": 1.1}]}}
    assert refused(policy, high) is None
    # the plugin's own default noise_multiplier (1.0) counts when the job gives none
    assert refused({"min_dp_noise": 1.0}, {"plugins": {"server_receive": ["dp_central"]}}) is None
    assert refused({"min_dp_noise": 1.01}, {"plugins": {"server_receive": ["dp_central"]}}).rule == "policy.min_dp_noise"


def test_require_secure_aggregation():
    full = {"plugins": {"client_send": ["secagg"]}}
    plus = {"plugins": {"client_send": [{"name": "secagg", "neighbours": 4}]}}
    he = {"plugins": {"client_send": ["he"]}}
    assert refused({"require_secure_aggregation": "secagg"}, full) is None
    assert refused({"require_secure_aggregation": "secagg"}, plus).rule == "policy.require_secure_aggregation"
    assert refused({"require_secure_aggregation": "secagg+"}, plus) is None
    assert refused({"require_secure_aggregation": "secagg+"}, full) is None  # full SecAgg is SecAgg+ with every neighbour
    assert refused({"require_secure_aggregation": ["he", "secagg"]}, he) is None
    refusal = refused({"require_secure_aggregation": "he"}, {})
    assert refusal.rule == "policy.require_secure_aggregation" and "no secure aggregation" in refusal.reason


def test_ceilings():
    assert refused({"max_rounds": 10}, {}) is None  # the default, 10
    assert refused({"max_rounds": 9}, {}) == Refusal("policy.max_rounds", "the job asks rounds=10; this site allows at most 9")
    assert refused({"max_rounds": 20}, {"rounds": 20}) is None
    assert refused({"max_local_epochs": 2}, {"local": {"epochs": 2}}) is None
    assert refused({"max_local_epochs": 2}, {"local": {"epochs": 3}}).rule == "policy.max_local_epochs"
    # steps cannot be bounded by an epoch ceiling: refused unless max_local_steps admits them
    assert refused({"max_local_epochs": 2}, {"local": {"steps": 5}}).rule == "policy.max_local_epochs"
    assert refused({"max_local_epochs": 2, "max_local_steps": 5}, {"local": {"steps": 5}}) is None
    assert refused({"max_local_steps": 4}, {"local": {"steps": 5}}).rule == "policy.max_local_steps"


def test_a_malformed_job_key_is_refused_by_the_rule_reading_it():
    refusal = refused({"max_rounds": 5}, {"rounds": "ten"})
    assert refusal == Refusal("policy.max_rounds", "job key 'rounds' is not an integer ('ten')")
    assert refused({"plugins": ["clip"]}, {"plugins": "clip"}).rule == "policy.code"  # read first by the code rule
    assert refused({}, ["not", "a", "mapping"]).rule == "policy"
    nan = {"plugins": {"client_send": [{"name": "dp_local", "noise_multiplier": float("nan")}]}}
    assert refused({"min_dp_noise": 1.0}, nan) == Refusal(
        "policy.min_dp_noise", "job key 'plugins.client_send[0].noise_multiplier' is not a finite number (nan)"
    )


def test_the_first_rule_in_order_is_reported():
    policy = {"strategies": ["fedavg"], "max_rounds": 1, "topologies": ["star"]}
    job = {"strategy": "scaffold", "rounds": 5, "topology": "ring"}
    assert refused(policy, job).rule == "policy.strategies"
    assert ORDER.index("strategies") < ORDER.index("topologies") < ORDER.index("max_rounds")


@pytest.mark.parametrize(
    ("policy", "message"),
    [
        ({"max_rounds": "ten"}, "config key 'policy.max_rounds': expected an integer or null, got 'ten'"),
        ({"max_rounds": 0}, "config key 'policy.max_rounds': must be >= 1, got 0"),
        ({"strategys": ["fedavg"]}, "unknown config key 'policy.strategys' (did you mean 'policy.strategies'?)"),
        ({"code": "sometimes"}, "config key 'policy.code'"),
        ({"code": ["abc"]}, "config key 'policy.code[0]': expected a sha256"),
        ({"strategies": ["fedavgg"]}, "config key 'policy.strategies[0]': 'fedavgg' is not one of"),
        ({"plugins": ["dp"]}, "config key 'policy.plugins[0]'"),
        ({"topologies": ["mesh"]}, "config key 'policy.topologies[0]'"),
        ({"require_secure_aggregation": "mpc"}, "config key 'policy.require_secure_aggregation': 'mpc'"),
        ({"min_dp_noise": -1}, "config key 'policy.min_dp_noise': must be >= 0"),
    ],
)
def test_load_errors_name_the_key(policy, message):
    with pytest.raises(ConfigError) as error:
        SitePolicy.from_dict(policy)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_describe_lists_the_rules_set():
    policy = SitePolicy.from_dict({"strategies": ["fedavg"], "code": [BUNDLE], "max_rounds": 3}, key="site.policy")
    assert policy.describe() == {"code": [BUNDLE], "strategies": ["fedavg"], "max_rounds": 3}


def test_user_code_lists_every_reference():
    job = {"strategy": "a.b:C", "task": {"dataset": "d:f", "metrics": ["accuracy", "m:n"]},
           "plugins": {"client_send": [{"name": "p:Q"}]}}
    assert sorted(user_code(job)) == sorted(
        [("strategy.name", "a.b:C"), ("task.dataset", "d:f"), ("task.metrics", "m:n"), ("plugins.client_send[0]", "p:Q")]
    )


def test_policy_catalog_entries_must_be_the_sites():
    policy = SitePolicy.from_dict({"catalog": ["cardiology", "oncolgy"]}, key="site.policy")
    policy.check_entries(["cardiology", "oncolgy"])
    with pytest.raises(ConfigError, match=r"config key 'site.policy.catalog\[1\]': 'oncolgy' is not an entry"):
        policy.check_entries(["cardiology", "oncology"], key="site.policy")
