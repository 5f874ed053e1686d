"""Ways of running the agents: on the driver, as a Spark barrier stage, over Spark Connect.

``stage`` is the only code touching ``BarrierTaskContext``; ``spark_driver`` answers the
driver's questions to Spark (session kind, conf, slots, driver address); ``session`` builds
the SparkSessions that sparkdist starts itself.
"""
