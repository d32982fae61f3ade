"""The ``kiln`` command line: the one place that reaches every component.

Each subcommand lives in its component and is imported only when it runs, so
``kiln plan`` works without torch and ``kiln operator`` without the runtime.
"""

from __future__ import annotations

import importlib
import sys

import click

from kiln import __version__

# name -> "module:attribute" of a click command, imported on first use.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "crd": ("kiln.commands:crd", "Print or write the LLMEngine (or LLMEnginePool) CRD generated from the API types."),
    "plan": ("kiln.commands:plan", "Show the build envelope and engine version of a manifest."),
    "render": ("kiln.operator.render:render",
               "Print the Kubernetes objects the operator would create for a manifest (YAML)."),
    "cache": ("kiln.cache_cli:cache", "List, show, remove and garbage-collect built engines in a store."),
    "build": ("kiln.builder.cli:build", "Build an engine artifact for a manifest into a store."),
    "build-adapter": ("kiln.builder.adapter.command:build_adapter_command",
                      "Build a LoRA adapter of spec.lora.adapters for the engine's base into a store."),
    "up": ("kiln.up:up", "Build (if missing) and serve a manifest on this machine, no Kubernetes."),
    "serve": ("kiln.serving.cli:serve", "Serve a model directory or engine artifact over an OpenAI-compatible API."),
    "operator": ("kiln.operator.cli:operator", "Run the Kubernetes operator."),
    "bench": ("kiln_bench.cli:bench", "Benchmark kiln against transformers baselines on one workload."),
    "make-model": ("kiln.engine.random_checkpoint:make_model_command", "Write a small random-weight model (no hub needed)."),
}


class LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(set(super().list_commands(ctx)) | set(SUBCOMMANDS))

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in SUBCOMMANDS:
            return super().get_command(ctx, name)
        target, _ = SUBCOMMANDS[name]
        module_name, attr = target.split(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            missing = getattr(exc, "name", None) or str(exc)
            how = ("`pip install ./bench` (kiln-bench, from a kiln checkout; `make install` does it)"
                   if module_name.startswith("kiln_bench") else "`pip install 'kiln[all]'`")
            raise click.ClickException(
                f"`kiln {name}` needs a component that is not installed ({missing}); install it with {how}"
            ) from None
        return getattr(module, attr)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        # Help must not import every component (and torch) just to list them.
        rows = [(name, SUBCOMMANDS[name][1]) for name in sorted(SUBCOMMANDS)]
        with formatter.section("Commands"):
            formatter.write_dl(rows)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="kiln")
def cli() -> None:
    """kiln: compile LLM checkpoints into cached engines and serve them."""


def main() -> None:
    cli(prog_name="kiln")


if __name__ == "__main__":
    sys.exit(main())
