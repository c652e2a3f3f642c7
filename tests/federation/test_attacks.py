"""Attacks on the site-side building blocks (policy, catalogue, bundles, audit log), each found working
once and fixed: a job, a bundle or a log crafted to get past what a site's rules promise."""

from __future__ import annotations

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
