"""The model runner: transformers models whose prefix KV comes from, and goes back to, the tiers.

Pure library code (no Ray): `serve_apps/` wraps it in Ray Serve deployments.
"""
