"""The kit's solutions to the exercises; `dh.reveal(name)` shows one, folded away. The checks
never use them as the learner's answer: the tests run them through the checks to prove each check
passes a right answer."""
