"""How a call runs: the planner (:mod:`.planner`), the GPU's cost model (:mod:`.costs`), the memory
budget (:mod:`.budget`), the ladder of filters (:mod:`.filters`) and the accuracy check that walks it
(:mod:`.accuracy`), and the printing of plans (:mod:`.explain`)."""
