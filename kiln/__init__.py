"""Imported as ``kiln`` (folder ``kiln/``): compile LLM checkpoints into cached engines and serve them.

This package is the shared core: the ``LLMEngine`` API types (:mod:`kiln.api`),
the build envelope and its version hash (:mod:`kiln.envelope`), the artifact
store (:mod:`kiln.artifacts`) and the ``kiln`` CLI (:mod:`kiln.cli`). It imports
neither torch nor Kubernetes; the components (``kiln.engine``, ``kiln.serving``,
``kiln.builder``, ``kiln.operator``) live in their own folders (``engine/``, ``serving_image/``,
``builder_job/``, ``operator/``) and extras: docs/architecture.md.
"""

__version__ = "0.1.0"

