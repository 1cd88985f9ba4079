"""Training integration: :class:`~bitps.worker.training.model.PSModel` (the five-line
integration), the overlap of backward with push/pull (:mod:`.overlap`, :mod:`.comm`,
:mod:`.buckets`, :mod:`.utilization`), clipping under overlap (:mod:`.clip`) and the torch
codecs (:mod:`.codec_torch`)."""
