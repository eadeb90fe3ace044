"""fab dashboard: the team's cluster in a browser, read-only (docs/observability.md).

views.py (pure) shapes what `fab top` and `fab status` read from the hosts, and what runs/JOB holds,
into the JSON documents the page polls; server.py serves them and the page (static/: one HTML, one
JS, one CSS file, nothing fetched from elsewhere) from a local HTTP server, with one background
refresher asking the hosts every few seconds however many browsers look.
"""
