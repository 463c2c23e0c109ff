"""cudabuild: a content-keyed build graph for lowering PyTorch models through AOTInductor.

Importing this package must stay cheap: it never imports torch or executorch. Heavy imports live
inside the stage functions that need them (see cudabuild/stages/).
"""

__version__ = "0.1.0"
