"""``dadfl.client`` — the site: config, local data, the model replica, the strategy's site half, the stream to the server.

``dadfl site --config configs/site-a.toml`` runs it (:func:`.site.run_site`).
"""
