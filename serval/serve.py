"""Serval's Serve application builders under Serval's own package name, for a Serve YAML's ``import_path``:

    import_path: serval.serve:build_openai_app        # Ray Serve LLM's ray.serve.llm:build_openai_app
    import_path: serval.serve:build_pd_openai_app     # ray.serve.llm:build_pd_openai_app

The same builders as ``deployments.app``'s. A user repository with its own top-level ``deployments``
package ahead of Serval's on the application's path is named in an ImportError here, instead of its
``deployments.app`` being imported in Serval's place.
"""

from pathlib import Path

import deployments

_SERVAL_ROOT = Path(__file__).resolve().parent.parent
if Path(deployments.__file__).resolve().parent.parent != _SERVAL_ROOT:
    raise ImportError(
        f"The package `deployments` at {Path(deployments.__file__).parent} shadows Serval's ({_SERVAL_ROOT}): "
        "rename it, or put Serval's directory ahead of it on the path."
    )

from deployments.app import build_openai_app, build_pd_openai_app  # noqa: E402 (after the check)

__all__ = ["build_openai_app", "build_pd_openai_app"]
