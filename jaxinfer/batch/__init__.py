"""Resumable batch jobs: input lines, records, OpenAI batch files, the output file and its lock, key tables,
the job itself and its Ray form."""
