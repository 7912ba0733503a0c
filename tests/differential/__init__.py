"""Differential tests: the same raw protocol exchanges against real beanstalkd 1.12 and our broker."""
