"""`make demo`: a real DDP job on the dev cluster, a real straggler, detected and evicted."""
