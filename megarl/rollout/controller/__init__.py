"""The partial-rollout controller: rounds the trainer asks for (`rounds.py`), the controller
that serves them (`partial.py`) with its groups and slots, admission, serving, carry-over, the
staleness rule (`staleness.py`), episode turns, the lag queue and the sync baseline. Sits above
engines/ and weights/: it drives the pool and never moves weights itself."""
