"""The rules: how long to wait for ranks and when to stop waiting (a failure the others wait
on, a collective that cannot complete, a mismatch in the ledgers), and the evidence a wait
ends with. They read a rank set (engine/sets) and never change what it recorded; the words
(engine/words) turn the evidence into the learner's message."""
