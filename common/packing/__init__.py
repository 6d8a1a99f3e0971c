"""Training data as the learner eats it: records encoded to teacher-forced segments, segments packed
into version-pure packs, and the A/B step schedule that asks for them.
"""
