"""The FSDP2 job of ``fsdp2_plain.py``, instrumented with one call (the explicit API).

``slurm_plugin.telemetry.fsdp.attach(model)`` times every optimizer step and the rank's wait
in FSDP2's collectives; the peer group comes from the model's device mesh (HSDP and 2-D meshes
included).

    srun python examples/fsdp2_train.py --steps 300 --ckpt-dir /shared/ckpt
"""

from __future__ import annotations

from fsdp2_plain import main

from slurm_plugin.telemetry import fsdp

if __name__ == "__main__":
    main(on_model=lambda model, start: fsdp.attach(model, start_step=start))
