"""After the step: the all-gather of updated params and the wait before they are read."""
