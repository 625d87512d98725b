"""Offline bucket research: strategies, traces and the `jaxinfer buckets` CLI. The runtime never imports it."""
