"""The LoRA adapter build (``kiln build-adapter``): an adapter of ``spec.lora.adapters`` built as its own artifact,
by the same stage loop as engines (:func:`kiln.builder.stage_loop.run_stages`) over an
:class:`~kiln.builder.adapter.context.AdapterContext`. The stages are ``stages/``; ``source``, ``peft_files`` and
``quality`` are the libraries they call; ``command`` is the command around them (its cache-hit path imports no
torch)."""
