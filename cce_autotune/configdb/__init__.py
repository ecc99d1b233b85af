"""The tuned-config database: the YAML files and their schema (:mod:`.store`), and the lookup of a
GPU's kernel variants and cost model for a call (:mod:`.dispatch`)."""
