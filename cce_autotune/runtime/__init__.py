"""The loss at run time: the custom operators (:mod:`.ops`), one call's tensors (:mod:`.call`), the
execution of a call's plan (:mod:`.execute`) and the chunked PyTorch path (:mod:`.reference`)."""
