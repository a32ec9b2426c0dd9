"""kvcluster as a vLLM KV connector (`KVClusterConnector`).

Load it through vLLM's `kv_transfer_config`:

    {"kv_connector": "KVClusterConnector",
     "kv_connector_module_path": "kvcluster.integrations.vllm.connector",
     "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
     "kv_connector_extra_config": {"tiers": [{"kind": "dram", "capacity": "512MiB"}]}}

`base.py` (the store protocol the connector talks to), `store.py` (the tiers behind the connector, configured by
`kv_connector_extra_config`) and `paged_kv.py`
(blocks moved between the paged KV tensors and host rows, batched, on any device) import no vLLM;
`connector.py` does, so only that module needs the engine installed.
"""
