"""The federation as a service: a long-lived server, sites that join once, jobs submitted to it.

Site-side building blocks: :mod:`~fedweave.federation.policy` (what a site accepts),
:mod:`~fedweave.federation.catalog` (the site's data, named by entry), :mod:`~fedweave.federation.bundle`
(code shipped as content-addressed archives) and :mod:`~fedweave.federation.audit` (the hash-chained
decision log).
"""
