"""The sanitizer at run time: `Sanitizer` (sanitizer.py) routes the graph hooks to the capture
analysis (capture.py) and the replay judge, and applies the policy; parts.py builds its parts in
the order they need each other."""
