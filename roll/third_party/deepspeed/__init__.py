"""DeepSpeed internals: offloading and reloading engine states, checkpoints, AutoTP layout, spill files."""
