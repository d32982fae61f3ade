"""An adapter build's stages, one module each, named as the adapter's build report names the stage
(``stage_seconds``). Each ``run(ctx)`` works on the one :class:`kiln.builder.adapter.context.AdapterContext`;
:data:`kiln.builder.adapter.pipeline.STAGES` lists them in order (and ends with the engine's own ``publish``)."""
