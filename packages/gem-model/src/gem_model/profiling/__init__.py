"""``gem-train profile``: the shape of the workload before choosing a recipe.

One module per section (:mod:`.sequences`, :mod:`.balance`, :mod:`.memory`, :mod:`.comm`,
:mod:`.step_time`, :mod:`.mfu`, :mod:`.recommend`), the data model (:mod:`.report`, a leaf module
plugins build sections with), what sections get (:mod:`.context`), the order they run in
(:mod:`.runner`), the training steps the step-time and MFU sections measure (:mod:`.step_probe`,
with the GPU's power and clock from :mod:`.device_power`) and the outputs (:mod:`.render`: terminal
tables, JSON and HTML; :mod:`.plots`: PNGs, with the ``gem-model[report]`` extra). Plugins add
sections through ``gem_profile_sections`` and ``gem-train profile`` subcommands through
``gem_profile_commands``. Nothing heavy is imported here.
"""
