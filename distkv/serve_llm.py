"""Ray Serve LLM's LLMServer, telling distkv's router who its vLLM engine is in distkv.

For an existing Serve LLM application whose engines run distkv (`spec_module_path:
distkv.vllm`), two lines of its LLM config route it with distkv's router
(docs/quickstart.md):

    server_cls: distkv.serve_llm:DistkvLLMServer
    deployment_config:
      request_router_config:
        request_router_class: distkv.serve_router:DistkvRequestRouter

The engine's distkv manager runs in vLLM's engine-core process and publishes its routing
stats under its engine id (`distkv.vllm.publish_identity`); this server names its engine
after its Serve replica (`kv_transfer_config.engine_id`, which then needs no setting of its
own) and adds those stats to what it returns to Serve's `record_routing_stats`. It needs
Ray Serve LLM (`pip install 'ray[llm]'`).
"""

from __future__ import annotations

from typing import Any

from ray import serve
from ray.experimental import internal_kv
from ray.llm._internal.serve.core.server.llm_server import LLMServer

from distkv.routing.identity import KV_NAMESPACE, name_engine, read_identity, with_identity


class DistkvLLMServer(LLMServer):
    async def __init__(self, llm_config, *args, **kwargs):
        self._distkv_engine_id = name_engine(llm_config.engine_kwargs, serve.get_replica_context().replica_id.unique_id)
        self._distkv_hash_algo = llm_config.engine_kwargs.get("prefix_caching_hash_algo", "sha256")
        await super().__init__(llm_config, *args, **kwargs)

    async def record_routing_stats(self) -> dict[str, Any]:
        stats = await super().record_routing_stats()
        published = read_identity(
            self._distkv_engine_id, lambda key: internal_kv._internal_kv_get(key, namespace=KV_NAMESPACE)
        )
        return with_identity(stats, published, self._distkv_hash_algo)
