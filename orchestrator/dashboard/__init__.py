"""fab dashboard: the team's cluster in a browser, read-only (docs/observability.md).

views.py (pure) shapes what `fab top` and `fab status` read from the hosts, and what runs/JOB holds,
into the JSON documents the page polls; cache.py makes them once and keeps them for every browser
(one background refresher asking the hosts every few seconds however many browsers look, a job's
page until its run's files change); handler.py answers each request with them or with the page
(static/: one HTML, one JS, one CSS file, nothing fetched from elsewhere), behind gate.py (who may
read it); server.py runs the local HTTP server.
"""
