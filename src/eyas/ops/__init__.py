"""The inspecting commands: status (what state is a run in), doctor (what do I do
now) and the demo, which runs the whole pipeline on the built-in target."""
