"""The rank sets: the parent's side of one set of ranks, behind one seam (`base.RankSet`) that
the pool, launch and the rules use, with two implementations: `forked.ForkedSet` (processes
the kit forked, over pipes) and `attached.AttachedSet` (ranks torchrun or Slurm started, over
the sockets `listener.Listener` let in). They observe (replies, output, exits, where each rank
is) and never decide: the rules (engine/rules) and the words (engine/words) do that.
"""
