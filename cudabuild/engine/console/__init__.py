"""What a person sees of a build, and its timeline:

- terminal.py: cudabuild's own lines on the terminal, and each stage's third-party output in its log;
- progress.py: doit's reporter: progress while stages run, failures, the summary;
- trace.py: build/<model>/<target>/trace.json, the Chrome trace of stages and their phases;
- report.py: `cudabuild report`, the last builds' seconds per stage from the build log.

None of it decides or computes anything a build produces; the engine's core and the backend's
stages call into it.
"""
