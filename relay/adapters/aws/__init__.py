"""What the AWS brokers (``sqs``, ``sns``) share: their common options and settings
(:mod:`.settings`), the classification of AWS failures (:mod:`.classify`), the checks,
attributes and packing of batch entries (:mod:`.entries`) and the batch publisher
(:mod:`.publisher`). Not a broker itself: ``--broker`` names ``sqs`` or ``sns``."""
