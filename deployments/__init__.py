"""Ray Serve deployments: only what Ray Serve imports (``serval/`` holds the commands that deploy them).

- ``app``: ``build_openai_app`` and ``build_pd_openai_app``, the builders a config's ``import_path`` names.
- ``llm_config``: ``LLMConfig`` / ``LLMServingArgs``, a config's ``args`` (Ray Serve LLM's vocabulary).
- ``deployment_options``, ``placement_config``, ``model_paths``: a deployment's options, where its engine
  runs, where its files are.
- ``ingress``: ``OpenAiIngress`` and ``IngressLLMServer``, the app's HTTP ingress.
- ``llm_server``: ``LLMServer``, one data-parallel replica of one model (``AsyncLLM`` + ``OpenAIServing``).
- ``pd_config``, ``pd_servers``: disaggregated prefill/decode's args and its two pools.
- ``routing``: ``KVAwareRouter``; ``kv_index``: its index and policy (no Ray); ``routing_hints``: the
  ingress's prompt tokenization for it.
- ``migration``: ``MigratingCall``, a request moved off a replica that died.
- ``response_store``: the app's ``/v1/responses`` store, one named Ray actor per app (``RayResponseStore``).
- ``autoscaling``: ``TTFTPolicy``, a custom autoscaling policy on a TTFT objective.
- ``lora``: multi-LoRA on Serve (``serve.multiplexed``).
- ``metrics``: ``RayStatLogger`` and the router, migration and LoRA metrics; ``metrics_export``: ``GET /metrics``.
- ``node_address``: replicas' gRPC servers on the node's own address.
"""
