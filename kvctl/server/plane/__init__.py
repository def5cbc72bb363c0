"""A Dynamo fleet's event plane (NATS or ZMQ), its discovery stores, worker recovery and this router's id on it."""
