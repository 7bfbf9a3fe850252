"""Ray at the edge: `train --ray` on Ray Train (ray_train) and Ray Jobs submission (jobs).
Nothing else in loomtrain imports Ray."""
