from leat import hookimpl


@hookimpl
def register_commands(register):
    register("ray", "leat_ray.cli:ray")
