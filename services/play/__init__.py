"""Playing episodes, the one way: views, the episode loop, evaluation and in-process players.

A library (no ``__main__``): the coordinator, ``tandem eval``, the demo's warm-start and the RL
sweep all play their episodes through it. ``episode.play_episode`` is the loop;
``evaluation`` scores a player against the environment's scripted opponent; ``local`` runs fixed
weights in-process on the inference library's ``Engine`` (tokens drawn by
``services.inference.sampling.sample``, the engine's own sampler).
"""
