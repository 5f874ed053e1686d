"""The driver's engine behind every front door: start a run (``launch``) and watch it to its
result or error (``supervisor``)."""
