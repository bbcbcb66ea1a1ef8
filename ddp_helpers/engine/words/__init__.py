"""The words: every sentence the engine says about a run that went wrong. `failures` turns the
evidence a wait ended with (rules.wait.Evidence) into the one error the learner reads, for
launch and both kinds of pool; `mismatch` explains a mismatch side by side; `places` names a
cell as the learner knows it; `tracebacks` cleans what a rank sent; `errors` holds the
exception classes. Refusals of bad input are the front's (engine/options.py)."""
