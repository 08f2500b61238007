"""The operator's tools: status (what state is a run in), doctor (what do I do now),
estimate (the disk a run will take) and the demo, which runs the whole pipeline on the
built-in target."""
