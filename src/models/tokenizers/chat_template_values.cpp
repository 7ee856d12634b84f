// Python's operations on chat-template values (chat_template_values.h): truth, str(), ==, +,
// indexing, slicing, methods, json.dumps. Strings are UTF-8 and indexed, sliced and measured by
// code point, as Python's str is. Jinja's filters and tests: chat_template_filters.cpp.

#include "chat_template_values.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <ctime>

namespace difftrain::models::jinja::values {

// The helpers chat_template_filters.cpp shares (chat_template_values.h, detail).
namespace detail {

// The code points of a UTF-8 string, each as its bytes (a stray byte is one "code point").
std::vector<std::string> chars(const std::string& s) {
  std::vector<std::string> out;
  for (size_t i = 0; i < s.size();) {
    const auto c = static_cast<unsigned char>(s[i]);
    size_t n = c < 0x80 ? 1 : (c >> 5) == 0x6 ? 2 : (c >> 4) == 0xE ? 3 : (c >> 3) == 0x1E ? 4 : 1;
    if (i + n > s.size()) n = 1;
    for (size_t k = 1; k < n; ++k) {
      if ((static_cast<unsigned char>(s[i + k]) & 0xC0) != 0x80) n = 1;
    }
    out.push_back(s.substr(i, n));
    i += n;
  }
  return out;
}

// Python's str.isspace() for one code point.
bool is_space(const std::string& c) {
  static const char* kSpaces[] = {" ",
                                  "\t",
                                  "\n",
                                  "\r",
                                  "\v",
                                  "\f",
                                  "\x1c",
                                  "\x1d",
                                  "\x1e",
                                  "\x1f",
                                  "\xc2\x85",
                                  "\xc2\xa0",
                                  "\xe1\x9a\x80",
                                  "\xe2\x80\xa8",
                                  "\xe2\x80\xa9",
                                  "\xe2\x80\xaf",
                                  "\xe2\x81\x9f",
                                  "\xe3\x80\x80"};
  for (const char* s : kSpaces) {
    if (c == s) return true;
  }
  // U+2000 .. U+200A
  return c.size() == 3 && c[0] == '\xe2' && c[1] == '\x80' &&
         static_cast<unsigned char>(c[2]) >= 0x80 && static_cast<unsigned char>(c[2]) <= 0x8a;
}

std::string join(const std::vector<std::string>& parts, size_t from, size_t to) {
  std::string out;
  for (size_t k = from; k < to; ++k) out += parts[k];
  return out;
}

bool is_number(const Json& j) { return j.is_number() || j.is_boolean(); }
bool is_int(const Json& j) { return j.is_number_integer() || j.is_boolean(); }
int64_t as_int(const Json& j) {
  return j.is_boolean() ? (j.get<bool>() ? 1 : 0) : j.get<int64_t>();
}
double as_double(const Json& j) {
  return j.is_boolean() ? (j.get<bool>() ? 1.0 : 0.0) : j.get<double>();
}

const std::string& str_of(const Value& v, const std::string& what) {
  if (v.kind != Value::Kind::kData || !v.json.is_string()) {
    throw TypeError(what + " must be a string, not " + type_name(v));
  }
  return v.json.get_ref<const std::string&>();
}

void check_defined(const Value& v) {
  if (v.kind == Value::Kind::kUndefined) throw TypeError(v.why.empty() ? "undefined value" : v.why);
}

// Python's str.strip / lstrip / rstrip (chars: none means whitespace).
std::string strip(const std::string& s, const Value* chars_arg, bool left, bool right) {
  const auto cs = chars(s);
  std::vector<std::string> set;
  const bool whitespace = chars_arg == nullptr ||
                          (chars_arg->kind == Value::Kind::kData && chars_arg->json.is_null()) ||
                          chars_arg->kind == Value::Kind::kUndefined;
  if (!whitespace) set = chars(str_of(*chars_arg, "strip's argument"));
  auto strip_it = [&](const std::string& c) {
    return whitespace ? is_space(c) : std::find(set.begin(), set.end(), c) != set.end();
  };
  size_t b = 0;
  size_t e = cs.size();
  if (left) {
    while (b < e && strip_it(cs[b])) ++b;
  }
  if (right) {
    while (e > b && strip_it(cs[e - 1])) --e;
  }
  return join(cs, b, e);
}

// Python's str.split(sep=None, maxsplit=-1).
Json split(const std::string& s, const Value* sep_arg, int64_t maxsplit) {
  Json out = Json::array();
  const bool whitespace =
      sep_arg == nullptr || (sep_arg->kind == Value::Kind::kData && sep_arg->json.is_null());
  if (whitespace) {
    const auto cs = chars(s);
    size_t k = 0;
    int64_t splits = 0;
    while (k < cs.size()) {
      while (k < cs.size() && is_space(cs[k])) ++k;
      if (k >= cs.size()) break;
      if (maxsplit >= 0 && splits == maxsplit) {
        size_t e = cs.size();
        while (e > k && is_space(cs[e - 1])) --e;
        out.push_back(join(cs, k, e));
        break;
      }
      size_t e = k;
      while (e < cs.size() && !is_space(cs[e])) ++e;
      out.push_back(join(cs, k, e));
      ++splits;
      k = e;
    }
    return out;
  }
  const std::string sep = str_of(*sep_arg, "split's separator");
  if (sep.empty()) throw TypeError("empty separator");
  size_t pos = 0;
  int64_t splits = 0;
  while (maxsplit < 0 || splits < maxsplit) {
    const size_t found = s.find(sep, pos);
    if (found == std::string::npos) break;
    out.push_back(s.substr(pos, found - pos));
    pos = found + sep.size();
    ++splits;
  }
  out.push_back(s.substr(pos));
  return out;
}

std::string replace(const std::string& s, const std::string& old, const std::string& with,
                    int64_t count) {
  if (old.empty()) return s;  // Python inserts between characters; no template relies on it
  std::string out;
  size_t pos = 0;
  int64_t done = 0;
  while (count < 0 || done < count) {
    const size_t found = s.find(old, pos);
    if (found == std::string::npos) break;
    out += s.substr(pos, found - pos) + with;
    pos = found + old.size();
    ++done;
  }
  return out + s.substr(pos);
}

std::string ascii_case(std::string s, bool upper) {
  for (auto& c : s)
    c = static_cast<char>(upper ? std::toupper(static_cast<unsigned char>(c))
                                : std::tolower(static_cast<unsigned char>(c)));
  return s;
}

std::string title(const std::string& s) {
  std::string out = s;
  bool previous_letter = false;
  for (auto& c : out) {
    const bool letter = std::isalpha(static_cast<unsigned char>(c)) != 0;
    if (letter) {
      c = static_cast<char>(previous_letter ? std::tolower(static_cast<unsigned char>(c))
                                            : std::toupper(static_cast<unsigned char>(c)));
    }
    previous_letter = letter;
  }
  return out;
}

std::string py_repr_string(const std::string& s) {
  const bool has_single = s.find('\'') != std::string::npos;
  const bool has_double = s.find('"') != std::string::npos;
  const char q = has_single && !has_double ? '"' : '\'';
  std::string out(1, q);
  for (const char ch : s) {
    const auto c = static_cast<unsigned char>(ch);
    if (ch == q || ch == '\\') {
      out += '\\';
      out += ch;
    } else if (ch == '\n') {
      out += "\\n";
    } else if (ch == '\r') {
      out += "\\r";
    } else if (ch == '\t') {
      out += "\\t";
    } else if (c < 0x20 || c == 0x7f) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\x%02x", c);
      out += buf;
    } else {
      out += ch;
    }
  }
  return out + q;
}

// Python's repr() of JSON data (str() of a list or dict shows its items' repr).
std::string py_repr(const Json& j) {
  if (j.is_string()) return py_repr_string(j.get_ref<const std::string&>());
  if (j.is_array()) {
    std::string out = "[";
    for (size_t k = 0; k < j.size(); ++k) out += (k > 0 ? ", " : "") + py_repr(j[k]);
    return out + "]";
  }
  if (j.is_object()) {
    std::string out = "{";
    bool first = true;
    for (const auto& [key, value] : j.items()) {
      out += (first ? "" : ", ") + py_repr_string(key) + ": " + py_repr(value);
      first = false;
    }
    return out + "}";
  }
  return to_str(Value::data(j));
}

const Value* arg(const std::vector<Value>& args, const Keywords& keywords, size_t position,
                 const std::string& name) {
  for (const auto& [key, value] : keywords) {
    if (key == name) return &value;
  }
  return position < args.size() ? &args[position] : nullptr;
}

int64_t int_arg(const Value* v, int64_t fallback, const std::string& what) {
  if (v == nullptr || v->kind == Value::Kind::kUndefined ||
      (v->kind == Value::Kind::kData && v->json.is_null())) {
    return fallback;
  }
  if (v->kind != Value::Kind::kData || !is_int(v->json)) {
    throw TypeError(what + " must be an integer, not " + type_name(*v));
  }
  return as_int(v->json);
}

// Python's slice.indices(n).
std::vector<int64_t> slice_indices(int64_t n, const Value& a, const Value& b, const Value& c) {
  const int64_t step = int_arg(&c, 1, "a slice step");
  if (step == 0) throw TypeError("slice step cannot be zero");
  auto bound = [&](const Value& v, int64_t fallback, bool is_stop) {
    (void)is_stop;
    int64_t x = int_arg(&v, INT64_MIN, "a slice index");
    if (x == INT64_MIN) return fallback;
    if (x < 0) x += n;
    if (step > 0) return std::clamp<int64_t>(x, 0, n);
    return std::clamp<int64_t>(x, -1, n - 1);
  };
  const int64_t start = bound(a, step > 0 ? 0 : n - 1, false);
  const int64_t stop = bound(b, step > 0 ? n : -1, true);
  std::vector<int64_t> out;
  for (int64_t k = start; step > 0 ? k < stop : k > stop; k += step) out.push_back(k);
  return out;
}

bool equals(const Value& a, const Value& b) {
  if (a.kind == Value::Kind::kUndefined || b.kind == Value::Kind::kUndefined)
    return a.kind == b.kind;
  if (a.kind == Value::Kind::kNamespace || b.kind == Value::Kind::kNamespace) return a.ns == b.ns;
  if (is_number(a.json) && is_number(b.json)) {
    if (is_int(a.json) && is_int(b.json)) return as_int(a.json) == as_int(b.json);
    return as_double(a.json) == as_double(b.json);
  }
  return a.json == b.json;
}

bool contains(const Value& container, const Value& item) {
  if (container.kind == Value::Kind::kUndefined) return false;
  if (container.kind == Value::Kind::kNamespace) return container.ns->contains(to_str(item));
  const Json& c = container.json;
  if (c.is_string()) {
    return c.get_ref<const std::string&>().find(
               str_of(item, "the left operand of 'in <string>'")) != std::string::npos;
  }
  if (c.is_array()) {
    for (const auto& x : c) {
      if (equals(Value::data(x), item)) return true;
    }
    return false;
  }
  if (c.is_object())
    return item.kind == Value::Kind::kData && item.json.is_string() &&
           c.contains(item.json.get<std::string>());
  throw TypeError("argument of type '" + type_name(container) + "' is not iterable");
}

}  // namespace detail

using namespace detail;

bool truthy(const Value& v) {
  if (v.kind == Value::Kind::kUndefined) return false;
  if (v.kind == Value::Kind::kNamespace) return true;
  const Json& j = v.json;
  if (j.is_null()) return false;
  if (j.is_boolean()) return j.get<bool>();
  if (j.is_number_float()) return j.get<double>() != 0.0;
  if (j.is_number()) return j.get<int64_t>() != 0;
  // (nlohmann's empty() is false for every string: a string is not a container to it)
  if (j.is_string()) return !j.get_ref<const std::string&>().empty();
  if (j.is_array() || j.is_object()) return !j.empty();
  return true;
}

std::string type_name(const Value& v) {
  if (v.kind == Value::Kind::kUndefined) return "undefined";
  if (v.kind == Value::Kind::kNamespace) return "Namespace";
  const Json& j = v.json;
  if (j.is_null()) return "NoneType";
  if (j.is_boolean()) return "bool";
  if (j.is_number_float()) return "float";
  if (j.is_number()) return "int";
  if (j.is_string()) return "str";
  if (j.is_array()) return "list";
  return "dict";
}

std::string to_str(const Value& v) {
  if (v.kind == Value::Kind::kUndefined) return "";
  if (v.kind == Value::Kind::kNamespace) return "<Namespace " + py_repr(*v.ns) + ">";
  const Json& j = v.json;
  if (j.is_string()) return j.get<std::string>();
  if (j.is_null()) return "None";
  if (j.is_boolean()) return j.get<bool>() ? "True" : "False";
  if (j.is_number_float()) return float_repr(j.get<double>());
  if (j.is_number()) return j.dump();
  return py_repr(j);
}

Json to_json(const Value& v) {
  check_defined(v);
  return v.kind == Value::Kind::kNamespace ? *v.ns : v.json;
}

std::vector<Value> iterate(const Value& v) {
  std::vector<Value> out;
  if (v.kind == Value::Kind::kUndefined) return out;
  if (v.kind == Value::Kind::kNamespace) throw TypeError("'Namespace' object is not iterable");
  const Json& j = v.json;
  if (j.is_array()) {
    for (const auto& x : j) out.push_back(Value::data(x));
  } else if (j.is_object()) {
    for (const auto& [key, value] : j.items()) out.push_back(Value::data(key));
  } else if (j.is_string()) {
    for (auto& c : chars(j.get_ref<const std::string&>())) out.push_back(Value::data(c));
  } else {
    throw TypeError("'" + type_name(v) + "' object is not iterable");
  }
  return out;
}

Value get_attr(const Value& obj, const std::string& name) {
  check_defined(obj);
  if (obj.kind == Value::Kind::kNamespace) {
    if (obj.ns->contains(name)) return Value::data(obj.ns->at(name));
    return Value::undefined("'Namespace' object has no attribute '" + name + "'");
  }
  if (obj.json.is_object() && obj.json.contains(name)) return Value::data(obj.json.at(name));
  return Value::undefined("'" + type_name(obj) + " object' has no attribute '" + name + "'");
}

Value get_item(const Value& obj, const Value& key) {
  check_defined(obj);
  if (key.kind == Value::Kind::kData && key.json.is_string())
    return get_attr(obj, key.json.get<std::string>());
  if (obj.kind == Value::Kind::kData && key.kind == Value::Kind::kData && is_int(key.json)) {
    int64_t k = as_int(key.json);
    if (obj.json.is_array()) {
      const auto n = static_cast<int64_t>(obj.json.size());
      if (k < 0) k += n;
      if (k >= 0 && k < n) return Value::data(obj.json[static_cast<size_t>(k)]);
      return Value::undefined("list index out of range");
    }
    if (obj.json.is_string()) {
      const auto cs = chars(obj.json.get_ref<const std::string&>());
      const auto n = static_cast<int64_t>(cs.size());
      if (k < 0) k += n;
      if (k >= 0 && k < n) return Value::data(cs[static_cast<size_t>(k)]);
      return Value::undefined("string index out of range");
    }
  }
  return Value::undefined("'" + type_name(obj) + " object' has no item " + to_str(key));
}

Value slice(const Value& obj, const Value& start, const Value& stop, const Value& step) {
  check_defined(obj);
  if (obj.kind == Value::Kind::kData && obj.json.is_array()) {
    Json out = Json::array();
    for (const int64_t k :
         slice_indices(static_cast<int64_t>(obj.json.size()), start, stop, step)) {
      out.push_back(obj.json[static_cast<size_t>(k)]);
    }
    return Value::data(out);
  }
  if (obj.kind == Value::Kind::kData && obj.json.is_string()) {
    const auto cs = chars(obj.json.get_ref<const std::string&>());
    std::string out;
    for (const int64_t k : slice_indices(static_cast<int64_t>(cs.size()), start, stop, step)) {
      out += cs[static_cast<size_t>(k)];
    }
    return Value::data(out);
  }
  throw TypeError("'" + type_name(obj) + "' object is not subscriptable");
}

Value call_method(const Value& obj, const std::string& name, const std::vector<Value>& args,
                  const Keywords& keywords) {
  check_defined(obj);
  if (obj.kind == Value::Kind::kData && obj.json.is_string()) {
    const std::string& s = obj.json.get_ref<const std::string&>();
    if (name == "startswith" || name == "endswith") {
      const Value* a = arg(args, keywords, 0, "prefix");
      if (a == nullptr) throw TypeError(name + "() takes one argument");
      std::vector<std::string> options;
      if (a->kind == Value::Kind::kData && a->json.is_array()) {
        for (const auto& x : a->json)
          options.push_back(str_of(Value::data(x), name + "'s argument"));
      } else {
        options.push_back(str_of(*a, name + "'s argument"));
      }
      for (const auto& o : options) {
        const bool hit =
            name == "startswith"
                ? s.compare(0, o.size(), o) == 0
                : s.size() >= o.size() && s.compare(s.size() - o.size(), o.size(), o) == 0;
        if (hit) return Value::data(true);
      }
      return Value::data(false);
    }
    if (name == "split") {
      return Value::data(split(s, arg(args, keywords, 0, "sep"),
                               int_arg(arg(args, keywords, 1, "maxsplit"), -1, "maxsplit")));
    }
    if (name == "strip" || name == "lstrip" || name == "rstrip") {
      return Value::data(
          strip(s, arg(args, keywords, 0, "chars"), name != "rstrip", name != "lstrip"));
    }
    if (name == "upper" || name == "lower") return Value::data(ascii_case(s, name == "upper"));
    if (name == "title") return Value::data(title(s));
    if (name == "capitalize") {
      std::string out = ascii_case(s, false);
      if (!out.empty())
        out[0] = static_cast<char>(std::toupper(static_cast<unsigned char>(out[0])));
      return Value::data(out);
    }
    if (name == "replace") {
      const Value* a = arg(args, keywords, 0, "old");
      const Value* b = arg(args, keywords, 1, "new");
      if (a == nullptr || b == nullptr) throw TypeError("replace() takes two arguments");
      return Value::data(replace(s, str_of(*a, "replace's old"), str_of(*b, "replace's new"),
                                 int_arg(arg(args, keywords, 2, "count"), -1, "count")));
    }
    if (name == "find" || name == "count") {
      const Value* a = arg(args, keywords, 0, "sub");
      if (a == nullptr) throw TypeError(name + "() takes one argument");
      const std::string sub = str_of(*a, name + "'s argument");
      if (name == "find") {
        const size_t at = s.find(sub);
        return Value::data(at == std::string::npos
                               ? int64_t{-1}
                               : static_cast<int64_t>(chars(s.substr(0, at)).size()));
      }
      int64_t n = 0;
      for (size_t at = s.find(sub); !sub.empty() && at != std::string::npos;
           at = s.find(sub, at + sub.size()))
        ++n;
      return Value::data(n);
    }
    if (name == "join") {
      const Value* a = arg(args, keywords, 0, "iterable");
      if (a == nullptr) throw TypeError("join() takes one argument");
      std::string out;
      bool first = true;
      for (const auto& item : iterate(*a)) {
        out += (first ? "" : s) + str_of(item, "join's items");
        first = false;
      }
      return Value::data(out);
    }
  } else if (obj.kind == Value::Kind::kData && obj.json.is_object()) {
    if (name == "items" || name == "keys" || name == "values") {
      Json out = Json::array();
      for (const auto& [key, value] : obj.json.items()) {
        if (name == "items") out.push_back(Json::array({key, value}));
        if (name == "keys") out.push_back(key);
        if (name == "values") out.push_back(value);
      }
      return Value::data(out);
    }
    if (name == "get") {
      const Value* a = arg(args, keywords, 0, "key");
      if (a == nullptr) throw TypeError("get() takes a key");
      const std::string key = to_str(*a);
      if (obj.json.contains(key)) return Value::data(obj.json.at(key));
      const Value* d = arg(args, keywords, 1, "default");
      return d != nullptr ? *d : Value::data(nullptr);
    }
  }
  throw TypeError("the method " + name + "() of a " + type_name(obj) +
                  " is not available in chat templates");
}

Value call_global(const std::string& name, const std::vector<Value>& args,
                  const Keywords& keywords) {
  if (name == "namespace" || name == "dict") {
    Json object = Json::object();
    for (const auto& a : args) {
      if (a.kind != Value::Kind::kData || !a.json.is_object()) {
        throw TypeError(name + "() takes keyword arguments or a dict");
      }
      for (const auto& [key, value] : a.json.items()) object[key] = value;
    }
    for (const auto& [key, value] : keywords) object[key] = to_json(value);
    if (name == "dict") return Value::data(object);
    Value v;
    v.kind = Value::Kind::kNamespace;
    v.ns = std::make_shared<Json>(std::move(object));
    return v;
  }
  if (name == "range") {
    if (args.empty() || args.size() > 3) throw TypeError("range() takes 1 to 3 arguments");
    const int64_t start = args.size() == 1 ? 0 : int_arg(&args[0], 0, "range's start");
    const int64_t stop = int_arg(&args[args.size() == 1 ? 0 : 1], 0, "range's stop");
    const int64_t step = args.size() == 3 ? int_arg(&args[2], 1, "range's step") : 1;
    if (step == 0) throw TypeError("range() arg 3 must not be zero");
    Json out = Json::array();
    for (int64_t k = start; step > 0 ? k < stop : k > stop; k += step) out.push_back(k);
    return Value::data(out);
  }
  if (name == "raise_exception") {
    throw TypeError("the template raised an exception: " +
                    (args.empty() ? std::string("(no message)") : to_str(args[0])));
  }
  if (name == "strftime_now") {
    if (args.empty()) throw TypeError("strftime_now() takes a format");
    const std::time_t now = std::time(nullptr);
    std::tm local{};
    localtime_r(&now, &local);
    char buf[256];
    const size_t n =
        std::strftime(buf, sizeof buf, str_of(args[0], "strftime_now's format").c_str(), &local);
    return Value::data(std::string(buf, n));
  }
  throw TypeError("'" + name + "' is undefined");
}

Value negate(const Value& v, bool negative) {
  check_defined(v);
  if (v.kind != Value::Kind::kData || !is_number(v.json)) {
    throw TypeError("bad operand type for unary " + std::string(negative ? "-" : "+") + ": '" +
                    type_name(v) + "'");
  }
  if (is_int(v.json)) return Value::data(negative ? -as_int(v.json) : as_int(v.json));
  return Value::data(negative ? -as_double(v.json) : as_double(v.json));
}

Value binary(const std::string& op, const Value& a, const Value& b) {
  if (op == "~") return Value::data(to_str(a) + to_str(b));
  check_defined(a);
  check_defined(b);
  auto unsupported = [&]() {
    return TypeError("unsupported operand type(s) for " + op + ": '" + type_name(a) + "' and '" +
                     type_name(b) + "'");
  };
  if (a.kind != Value::Kind::kData || b.kind != Value::Kind::kData) throw unsupported();
  const Json& x = a.json;
  const Json& y = b.json;
  if (op == "+") {
    if (x.is_string() && y.is_string())
      return Value::data(x.get<std::string>() + y.get<std::string>());
    if (x.is_array() && y.is_array()) {
      Json out = x;
      for (const auto& item : y) out.push_back(item);
      return Value::data(out);
    }
  }
  if (op == "*" && (x.is_string() || x.is_array()) && is_int(y)) {
    Json out = x.is_string() ? Json("") : Json::array();
    for (int64_t k = 0; k < as_int(y); ++k) {
      if (x.is_string()) {
        out = out.get<std::string>() + x.get<std::string>();
      } else {
        for (const auto& item : x) out.push_back(item);
      }
    }
    return Value::data(out);
  }
  if (!is_number(x) || !is_number(y)) throw unsupported();
  const bool ints = is_int(x) && is_int(y);
  if (op == "/") {
    if (as_double(y) == 0.0) throw TypeError("division by zero");
    return Value::data(as_double(x) / as_double(y));
  }
  if (ints) {
    const int64_t p = as_int(x);
    const int64_t q = as_int(y);
    if (op == "+") return Value::data(p + q);
    if (op == "-") return Value::data(p - q);
    if (op == "*") return Value::data(p * q);
    if (op == "//" || op == "%") {
      if (q == 0) throw TypeError("integer division or modulo by zero");
      int64_t quotient = p / q;
      if ((p % q != 0) && ((p < 0) != (q < 0))) --quotient;  // Python floors
      return Value::data(op == "//" ? quotient : p - quotient * q);
    }
    if (op == "**" && q >= 0) {
      int64_t r = 1;
      for (int64_t k = 0; k < q; ++k) r *= p;
      return Value::data(r);
    }
  }
  const double p = as_double(x);
  const double q = as_double(y);
  if (op == "+") return Value::data(p + q);
  if (op == "-") return Value::data(p - q);
  if (op == "*") return Value::data(p * q);
  if (op == "**") return Value::data(std::pow(p, q));
  if (op == "//" || op == "%") {
    if (q == 0.0) throw TypeError("float division or modulo by zero");
    const double quotient = std::floor(p / q);
    return Value::data(op == "//" ? quotient : p - quotient * q);
  }
  throw unsupported();
}

bool compare(const std::string& op, const Value& a, const Value& b) {
  if (op == "==") return equals(a, b);
  if (op == "!=") return !equals(a, b);
  if (op == "in") return contains(b, a);
  if (op == "not in") return !contains(b, a);
  check_defined(a);
  check_defined(b);
  int order = 0;
  if (a.kind == Value::Kind::kData && b.kind == Value::Kind::kData && is_number(a.json) &&
      is_number(b.json)) {
    const double p = as_double(a.json);
    const double q = as_double(b.json);
    order = p < q ? -1 : (p > q ? 1 : 0);
  } else if (a.kind == Value::Kind::kData && b.kind == Value::Kind::kData && a.json.is_string() &&
             b.json.is_string()) {
    order = a.json.get_ref<const std::string&>().compare(b.json.get_ref<const std::string&>());
  } else {
    throw TypeError("'" + op + "' not supported between instances of '" + type_name(a) + "' and '" +
                    type_name(b) + "'");
  }
  if (op == "<") return order < 0;
  if (op == "<=") return order <= 0;
  if (op == ">") return order > 0;
  return order >= 0;
}

}  // namespace difftrain::models::jinja::values
