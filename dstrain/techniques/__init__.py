"""The large-batch techniques, each a module with a pure function or a class at its centre: LARS and
LAMB (lars, lamb, multitensor), the optimizer table (optim), LR schedules and the scaling rule
(schedule), label smoothing (losses), ghost BN (bn_span), the BN refit of Final Polishing
(bn_refit), the models (models), dstrain's gradient communication and 2D-Torus (comm), the native
fp16 engine's loss scale (loss_scaling). Imports dstrain.core and dstrain.settings only."""
