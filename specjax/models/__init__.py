"""The target model and its files: config, the Llama-family decoder, weights of every format, specjax's own
checkpoints (`store`), loading onto a device or mesh, conversion, quantisation and the memory-bound expansion."""
