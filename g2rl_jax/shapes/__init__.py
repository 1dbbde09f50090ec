"""Shape planning: the one home of the shapes a run compiles. The trainer's warm-up (train/warmup.py), `plan
--compile` and its bill (aot/programs.py, aot/bill.py) and the benches all take their shapes from here.

    step.py     StepShapes: the worst-case sizes of a step on a mesh (prompts, prompt bucket, budget slots, rows,
                the decode's read rungs and batch buckets); a rollout's programs by kind; the finest packed layout
    layouts.py  the two layouts of the score, reference and gradient passes: ShapeSet (length-grouped micro-batches,
                their width ladder and row counts, the least-cost cut `group`) and PackShape (packed rows of the
                full width and narrower ones); micro_cost, the cost both minimise
    prices.py   the devices a run trains on (Device.of its training mesh), seconds to compile a program and seconds
                per micro_cost unit, from the FLOP model (train_flops) or measured
    choice.py   the candidates (grouped sets, packed layouts, prompt-bucket sets), their estimated run time, and the
                run's choice: `choose_for`; algorithm.packing true, false or null (chosen by the estimate)
    record.py   shape files: the run's choice recorded for its resumes (micro_shapes.json), or pinned
                (run.shapes_file, written by `python -m g2rl_jax.bench tune-shapes`)

What runs the shapes lives with the passes: train/micro.py cuts a step's rows into a ShapeSet's micro-batches,
train/packing.py packs them into a PackShape's rows, train/warmup.py compiles every program of the choice at the
first step. Nothing here compiles or runs a program, reads a clock or imports the benches or the demos.
"""
