"""The models the recipes build: architectures, where their weights come from, their quantization.

A model reads a build's options as attributes of one typed object (cudabuild.options.Options:
`options.layers`), which no module here imports: the stages keyed on a model module's imports (the
quantize stage, the reference's truth) need not follow the options' own code. Models import nothing
of the backend (tests/test_imports.py): the ops a model's forward calls are registered by the stage
that runs it.
"""
