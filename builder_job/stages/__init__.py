"""The build's stages, one module each, named as the build report names the stage (``stage_seconds``).

Each module's ``run(ctx)`` does its stage's work on the one :class:`kiln.builder.context.BuildContext`;
:data:`kiln.builder.pipeline.STAGES` lists them in the order a build runs them.
"""
