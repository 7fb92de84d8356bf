"""A checkpoint's lifecycle after its stage: the gate file, the logged model and the registry's promotion."""
