"""File formats, read and written by hand where the format's own library does not do what a build
needs: safetensors_parts.py reads a .safetensors header and digests its tensors without torch (the
keys, the up-front checks); safetensors_stream.py writes one tensor by tensor (the quantize stage).
They know no model, stage or store.
"""
